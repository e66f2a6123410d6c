"""CosFace (m3 = 0.4), IResNet-100 on WebFace4M, 128 images per GPU, SGD lr 0.1, weight decay 5e-4, 20 epochs, fp16
(arcface_torch's wf4m_r100)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r100"
config.fp16 = True
config.rec = "/train_tmp/WebFace4M"
config.num_classes = 205990
config.num_image = 4235242
