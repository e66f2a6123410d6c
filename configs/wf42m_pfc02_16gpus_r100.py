"""CosFace (m3 = 0.4), IResNet-100 on WebFace42M with Partial FC sampling 0.2, 256 images per GPU on 16 GPUs (global
batch 4096), SGD lr 0.3, weight decay 5e-4, 20 epochs with 1 of warm-up, fp16 (arcface_torch's
wf42m_pfc02_16gpus_r100)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r100"
config.sample_rate = 0.2
config.fp16 = True
config.lr = 0.3
config.batch_size = 256
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.warmup_epoch = 1
