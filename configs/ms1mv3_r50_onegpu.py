"""ArcFace (m2 = 0.5), IResNet-50 on MS1MV3 (ms1m-retinaface-t1), 128 images per GPU on 1 GPU (global batch 128), SGD
lr 0.02, weight decay 5e-4, 20 epochs, fp16 (arcface_torch's ms1mv3_r50_onegpu)."""
from easydict import EasyDict as edict

config = edict()
config.fp16 = True
config.lr = 0.02
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
