"""CosFace (m3 = 0.4), IResNet-100 on WebFace42M with Partial FC sampling 0.3, 128 images per GPU on 32 GPUs (global
batch 4096), SGD lr 0.4, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf42m_pfc03_32gpu_r100)."""
from easydict import EasyDict as edict

base = "wf42m_pfc03_32gpu_r50"  # every value of configs/wf42m_pfc03_32gpu_r50.py, then these
config = edict()
config.network = "r100"
