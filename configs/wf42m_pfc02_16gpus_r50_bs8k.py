"""CosFace (m3 = 0.4), IResNet-50 on WebFace42M with Partial FC sampling 0.2, 512 images per GPU on 16 GPUs (global
batch 8192), SGD lr 0.6, weight decay 5e-4, 20 epochs with 4 of warm-up, fp16 (arcface_torch's
wf42m_pfc02_16gpus_r50_bs8k)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.sample_rate = 0.2
config.fp16 = True
config.lr = 0.6
config.batch_size = 512
config.verbose = 10000
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.warmup_epoch = 4
