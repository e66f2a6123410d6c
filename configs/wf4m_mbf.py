"""CosFace (m3 = 0.4), MobileFaceNet on WebFace4M, 128 images per GPU, SGD lr 0.1, weight decay 1e-4, 20 epochs, fp16
(arcface_torch's wf4m_mbf)."""
from easydict import EasyDict as edict

base = "wf4m_r50"  # every value of configs/wf4m_r50.py, then these
config = edict()
config.network = "mbf"
config.weight_decay = 1e-4
