"""ArcFace, IResNet-50 on MS1MV2 (faces_emore), 8 GPUs x 128 images, fp16 (arcface_torch's ms1mv2_r50)."""
from easydict import EasyDict as edict

config = edict()
config.fp16 = True
config.weight_decay = 1e-4
config.rec = "/train_tmp/faces_emore"
config.num_classes = 85742
config.num_image = 5822653
