"""ArcFace (m2 = 0.5), IResNet-50 on MS1MV2 (faces_emore), 128 images per GPU, SGD lr 0.1, weight decay 5e-4, 20
epochs, fp16 (arcface_torch's ms1mv2_r50)."""
from easydict import EasyDict as edict

config = edict()
config.fp16 = True
config.rec = "/train_tmp/faces_emore"
config.num_classes = 85742
config.num_image = 5822653
