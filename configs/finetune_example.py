"""Fine-tune a published model on your own identities: ~1,000 identities x 5-20 images (docs/finetuning.md).

Not an arcface_torch recipe: a worked example of this trainer's fine-tuning keys. The backbone starts from a
published model (init_backbone: arcface_torch's model.pt / backbone.pth / checkpoint_gpu_0.pt, or a model.pt of
ours), the head is new. With 5-20 images an identity the backbone can only be nudged: at a tenth of the head's LR,
after the head has settled alone, with its batch-norm statistics and early stages kept. Replace the paths and
counts with yours, e.g. for a folder that scripts/prepare_faces.py wrote with --holdout:

    python train.py configs/finetune_example --set init_backbone=/models/ms1mv3_r50/model.pt \
        rec=/data/my_faces num_classes=1000 num_image=12000

network and embedding_size stay base's (r50, 512): they must be the published model's, which is loaded strictly.
"""
from easydict import EasyDict as edict

config = edict()
# The published model to start from (a placeholder: point it at yours).
config.init_backbone = "models/ms1mv3_arcface_r50/model.pt"
# Your identities (a RecordIO folder or a folder of identity folders) and their counts.
config.rec = "/data/my_faces"
config.num_classes = 1000
config.num_image = 12000
# The head is new: it trains at base's lr, 0.1, as in training from scratch. The backbone at a tenth of that
# (0.01): it keeps what millions of images taught it.
config.backbone_lr_scale = 0.1
# Batches of a thousand identities with few images each estimate batch-norm statistics worse than the
# pre-training did: normalise with the published model's.
config.freeze_bn = True
# The stem and layer1 see edges and textures, the same on any face: frozen (and the backward stops before them).
config.freeze_stages = 1
# The new head starts at random centres: its first gradients would pull the backbone towards noise. About two
# epochs of 94 steps (12,000 images / 128) for the head alone, then the whole network.
config.head_warmup_steps = 200
# About 1,000 steps: small data is seen many times, and more epochs only memorise it.
config.num_epoch = 10
# Half precision on the GPU, as the published recipes.
config.fp16 = True
# scripts/prepare_faces.py --holdout writes holdout.bin (pairs of identities kept out of training) into rec:
# verified every 100 steps, so that the best step shows.
config.val_targets = ["holdout"]
config.verbose = 100
