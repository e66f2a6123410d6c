"""CosFace (m3 = 0.4), IResNet-50 on WebFace42M with Partial FC sampling 0.2, 512 images per GPU on 8 GPUs (global
batch 4096), SGD lr 0.4, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf42m_pfc02_8gpus_r50_bs4k)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.sample_rate = 0.2
config.fp16 = True
config.lr = 0.4
config.batch_size = 512
config.verbose = 10000
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.warmup_epoch = 2
