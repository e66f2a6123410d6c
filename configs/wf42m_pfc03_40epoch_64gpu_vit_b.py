"""CosFace (m3 = 0.4), ViT-B (`vit_b_dp005_mask_005`) on WebFace42M with Partial FC sampling 0.3, 384 images per GPU on
64 GPUs (global batch 24576), AdamW lr 0.001, weight decay 0.1, 40 epochs with 4 of warm-up, fp16 (arcface_torch's
wf42m_pfc03_40epoch_64gpu_vit_b)."""
from easydict import EasyDict as edict

base = "wf42m_pfc03_40epoch_64gpu_vit_t"  # every value of configs/wf42m_pfc03_40epoch_64gpu_vit_t.py, then these
config = edict()
config.network = "vit_b_dp005_mask_005"
