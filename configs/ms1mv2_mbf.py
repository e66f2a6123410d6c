"""ArcFace (m2 = 0.5), MobileFaceNet on MS1MV2 (faces_emore), 128 images per GPU, SGD lr 0.1, weight decay 1e-4, 40
epochs, fp16 (arcface_torch's ms1mv2_mbf)."""
from easydict import EasyDict as edict

config = edict()
config.network = "mbf"
config.fp16 = True
config.weight_decay = 1e-4
config.rec = "/train_tmp/faces_emore"
config.num_classes = 85742
config.num_image = 5822653
config.num_epoch = 40
