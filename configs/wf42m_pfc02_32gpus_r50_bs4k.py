"""CosFace (m3 = 0.4), IResNet-50 on WebFace42M with Partial FC sampling 0.2, 128 images per GPU on 32 GPUs (global
batch 4096), SGD lr 0.4, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf42m_pfc02_32gpus_r50_bs4k)."""
from easydict import EasyDict as edict

base = "wf42m_pfc02_8gpus_r50_bs4k"  # every value of configs/wf42m_pfc02_8gpus_r50_bs4k.py, then these
config = edict()
config.batch_size = 128
