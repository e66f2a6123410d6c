"""CosFace (m3 = 0.4), MobileFaceNet on Glint360K, 128 images per GPU, SGD lr 0.1, weight decay 1e-4, 20 epochs, fp16
(arcface_torch's glint360k_mbf)."""
from easydict import EasyDict as edict

base = "glint360k_r50"  # every value of configs/glint360k_r50.py, then these
config = edict()
config.network = "mbf"
