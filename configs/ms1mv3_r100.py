"""ArcFace (m2 = 0.5), IResNet-100 on MS1MV3 (ms1m-retinaface-t1), 128 images per GPU, SGD lr 0.1, weight decay 5e-4,
20 epochs, fp16 (arcface_torch's ms1mv3_r100)."""
from easydict import EasyDict as edict

base = "ms1mv3_r50"  # every value of configs/ms1mv3_r50.py, then these
config = edict()
config.network = "r100"
