"""ArcFace, MobileFaceNet on MS1MV2 (faces_emore), 8 GPUs x 128 images, fp16, 40 epochs (arcface_torch's ms1mv2_mbf)."""
from easydict import EasyDict as edict

config = edict()
config.network = "mbf"
config.fp16 = True
config.weight_decay = 1e-4
config.rec = "/train_tmp/faces_emore"
config.num_classes = 85742
config.num_image = 5822653
config.num_epoch = 40
