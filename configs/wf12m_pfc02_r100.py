"""CosFace (m3 = 0.4), IResNet-100 on WebFace12M with Partial FC sampling 0.2, 128 images per GPU, SGD lr 0.1, weight
decay 5e-4, 20 epochs, fp16 (arcface_torch's wf12m_pfc02_r100)."""
from easydict import EasyDict as edict

base = "wf12m_r100"  # every value of configs/wf12m_r100.py, then these
config = edict()
config.sample_rate = 0.2
