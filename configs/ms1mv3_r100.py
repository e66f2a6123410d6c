"""ArcFace, IResNet-100 on MS1MV3 (ms1m-retinaface-t1), 8 GPUs x 128 images, fp16, lr 0.2 (arcface_torch's
ms1mv3_r100)."""
from easydict import EasyDict as edict

config = edict()
config.network = "r100"
config.fp16 = True
config.lr = 0.2
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 25
