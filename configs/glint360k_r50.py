"""CosFace (m3 = 0.4), IResNet-50 on Glint360K, 128 images per GPU, SGD lr 0.1, weight decay 1e-4, 20 epochs, fp16
(arcface_torch's glint360k_r50)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.fp16 = True
config.weight_decay = 1e-4
config.rec = "/train_tmp/glint360k"
config.num_classes = 360232
config.num_image = 17091657
