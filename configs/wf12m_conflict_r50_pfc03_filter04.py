"""CosFace (m3 = 0.4), IResNet-50 on WebFace12M_Conflict with Partial FC sampling 0.3, inter-class filtering at 0.4,
128 images per GPU, SGD lr 0.1, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf12m_conflict_r50_pfc03_filter04)."""
from easydict import EasyDict as edict

base = "wf12m_conflict_r50"  # every value of configs/wf12m_conflict_r50.py, then these
config = edict()
config.sample_rate = 0.3
config.interclass_filtering_threshold = 0.4
