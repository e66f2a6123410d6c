"""ArcFace, IResNet-50 on MS1MV3 (ms1m-retinaface-t1), 8 GPUs x 128 images, fp16, lr 0.2 with 2 warm-up epochs
(arcface_torch's ms1mv3_r50)."""
from easydict import EasyDict as edict

config = edict()
config.fp16 = True
config.lr = 0.2
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 25
config.warmup_epoch = 2
