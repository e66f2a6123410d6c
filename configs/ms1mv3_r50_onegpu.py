"""ArcFace (m2 = 0.5), IResNet-50 on MS1MV3 (ms1m-retinaface-t1), 128 images per GPU on 1 GPU (global batch 128), SGD
lr 0.02, weight decay 5e-4, 20 epochs, fp16 (arcface_torch's ms1mv3_r50_onegpu)."""
from easydict import EasyDict as edict

base = "ms1mv3_r50"  # every value of configs/ms1mv3_r50.py, then these
config = edict()
config.lr = 0.02
