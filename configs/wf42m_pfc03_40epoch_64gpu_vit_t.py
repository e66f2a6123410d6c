"""CosFace (m3 = 0.4), ViT-T (`vit_t_dp005_mask0`) on WebFace42M with Partial FC sampling 0.3, 384 images per GPU on 64
GPUs (global batch 24576), AdamW lr 0.001, weight decay 0.1, 40 epochs with 4 of warm-up, fp16 (arcface_torch's
wf42m_pfc03_40epoch_64gpu_vit_t)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "vit_t_dp005_mask0"
config.sample_rate = 0.3
config.fp16 = True
config.optimizer = "adamw"
config.lr = 0.001
config.weight_decay = 0.1
config.batch_size = 384
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 40
config.warmup_epoch = 4
config.val_targets = []
