"""ArcFace (m2 = 0.5), MobileFaceNet on MS1MV3 (ms1m-retinaface-t1), 128 images per GPU, SGD lr 0.1, weight decay 1e-4,
40 epochs, fp16 (arcface_torch's ms1mv3_mbf)."""
from easydict import EasyDict as edict

config = edict()
config.network = "mbf"
config.fp16 = True
config.weight_decay = 1e-4
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 40
