"""CosFace (m3 = 0.4), ViT-H (`vit_h`) on WebFace42M with Partial FC sampling 0.5, 768 images per GPU, AdamW lr 0.001,
weight decay 0.1, 16 epochs with 2 of warm-up, DALI loader, fp16 (arcface_torch's wf42m_pfc02_vit_h).

The recipe also sets `dali_aug = True` (random down-and-up resize, blur, hue/saturation shift, grayscale in the DALI
pipeline), which we refuse (see configs/base.py): this config trains with flips only, the one difference from the
published recipe."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "vit_h"
config.sample_rate = 0.5
config.fp16 = True
config.optimizer = "adamw"
config.lr = 0.001
config.weight_decay = 0.1
config.batch_size = 768
config.dali = True
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 16
config.warmup_epoch = 2
config.val_targets = []
