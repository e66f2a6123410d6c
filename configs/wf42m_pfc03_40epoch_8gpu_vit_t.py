"""CosFace (m3 = 0.4), ViT-T (`vit_t_dp005_mask0`) on WebFace42M with Partial FC sampling 0.3, 512 images per GPU on 8
GPUs (global batch 4096), AdamW lr 0.001, weight decay 0.1, 40 epochs with 4 of warm-up, fp16 (arcface_torch's
wf42m_pfc03_40epoch_8gpu_vit_t)."""
from easydict import EasyDict as edict

base = "wf42m_pfc03_40epoch_64gpu_vit_t"  # every value of configs/wf42m_pfc03_40epoch_64gpu_vit_t.py, then these
config = edict()
config.batch_size = 512
