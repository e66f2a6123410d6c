"""CosFace (m3 = 0.4), IResNet-100 on WebFace42M with Partial FC sampling 0.2, 128 images per GPU on 16 GPUs (global
batch 2048), SGD lr 0.2, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf42m_pfc02_r100_16gpus)."""
from easydict import EasyDict as edict

base = "wf42m_pfc02_r100"  # every value of configs/wf42m_pfc02_r100.py, then these
config = edict()
config.lr = 0.2
config.warmup_epoch = 2
