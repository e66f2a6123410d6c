"""CosFace (m3 = 0.4), ViT-B (`vit_b_dp005_mask_005`) on WebFace42M with Partial FC sampling 0.3, 256 images per GPU x
12 accumulated micro-batches on 8 GPUs (global batch 24576), AdamW lr 0.001, weight decay 0.1, 40 epochs with 4 of
warm-up, fp16 (arcface_torch's wf42m_pfc03_40epoch_8gpu_vit_b)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "vit_b_dp005_mask_005"
config.sample_rate = 0.3
config.fp16 = True
config.optimizer = "adamw"
config.lr = 0.001
config.weight_decay = 0.1
config.batch_size = 256
config.gradient_acc = 12
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 40
config.warmup_epoch = 4
config.val_targets = []
