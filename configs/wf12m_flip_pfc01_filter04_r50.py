"""CosFace (m3 = 0.4), IResNet-50 on WebFace12M_FLIP40 with Partial FC sampling 0.1, inter-class filtering at 0.4, 128
images per GPU, SGD lr 0.1, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf12m_flip_pfc01_filter04_r50)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.sample_rate = 0.1
config.interclass_filtering_threshold = 0.4
config.fp16 = True
config.rec = "/train_tmp/WebFace12M_FLIP40"
config.num_classes = 617970
config.num_image = 12720066
config.warmup_epoch = 2
config.val_targets = []
