"""Every configuration key, its default, and what it means.

Written from the declarations in ``utils/config_keys.py`` by ``python -m utils.config --write-base`` (a test
checks that the two agree): to add a key or change a default, edit its declaration there and run that command.

A recipe (``configs/ms1mv3_r50.py`` or any ``.py`` of yours) defines ``config`` holding only the keys that
differ from these defaults, or from the recipe it names as its ``base`` (``base = "ms1mv3_r50"``);
``utils.config.load_config`` merges them, rejects unknown keys and wrong types, and checks the values. Key
names and meanings follow insightface's ``arcface_torch`` so its configs keep working. The type of each
default is the type the loader accepts (an int is accepted where the default is a float), except for the keys
documented as optional or as taking two types.

Values computed from these (global batch, steps per epoch, total and warm-up steps) are never stored here:
see ``utils.config.derive``.
"""
from easydict import EasyDict as edict

config = edict()

# ---------------------------------------------------------------- model
# Backbone name in the `backbones` registry: r18 | r34 | r50 | r100 | r200 | r2060 | mbf | mbf_large | vit_t |
# vit_t_dp005_mask0 | vit_s | vit_s_dp005_mask_0 | vit_b | vit_b_dp005_mask_005 | vit_l_dp005_mask_005 | vit_h
# | tiny.
config.network = "r50"
# Extra keyword arguments for backbones.get_model (dict), e.g. {"widths": (8, 16, 16, 32)} for `tiny`.
config.network_kwargs = {}
# Dimension of the face embedding (the backbone output and the Partial FC class centres); >= 1.
config.embedding_size = 512
# Path of a backbone state_dict (.pt/.pth, e.g. an official model.pt) to start from, or None for random init.
# Ignored when the run resumes from a checkpoint (the checkpoint's weights win).
config.init_backbone = None
# Store activations in channels-last memory format (faster convolutions on recent GPUs; same results). Refused
# on the CPU for backbones with a strided 1x1 convolution of fewer than 16 input channels (narrow `tiny`
# widths), whose weight gradient oneDNN's CPU kernel computes out of bounds in that format.
config.channels_last = False
# Compile the backbone with torch.compile (faster steps on GPUs after a first slow step; same results up to
# rounding). The saved weights and model.pt are the plain module's.
config.compile = False
# torch.compile backend when compile = True: "inductor" (generated kernels, the fast one) or another of
# torch.compiler.list_backends(), e.g. "aot_eager" (traced, not code-generated: for debugging). On the CPU,
# inductor lays convolutions out channels-last, so it is refused where channels_last is (see above).
config.compile_backend = "inductor"

# ---------------------------------------------------------------- margin loss
# Margin: "combined" (the margin_list formula below: ArcFace, CosFace and their combinations) | "adaface"
# (AdaFace, CVPR 2022: each sample's margin follows its embedding norm relative to running statistics of the
# norms; set by adaface_m, adaface_h, adaface_t_alpha and margin_scale; margin_list does not apply and
# interclass filtering is refused). AdaFace's paper differentiates through its margin: margin_gradient =
# "exact".
config.margin = "combined"
# Combined margin (m1, m2, m3): target logit s * (cos(m1 * theta + m2) - m3). ArcFace: (1.0, 0.5, 0.0);
# CosFace: (1.0, 0.0, 0.4). m1 >= 1, 0 <= m2 < pi/2, m3 >= 0.
config.margin_list = (1.0, 0.5, 0.0)
# Logit scale s (the radius of the hypersphere); > 0.
config.margin_scale = 64.0
# Gradient through the margin: "straight_through" (as arcface_torch: the margin is applied without gradient,
# so d(target logit)/d(cos theta) is taken as 1) | "exact" (differentiate s * (cos(m1*theta + m2) - m3), or
# AdaFace's formula as its authors' code does).
config.margin_gradient = "straight_through"
# Inter-class filtering (arcface_torch): a sample's non-target cosines above this threshold are zeroed (likely
# label noise: the same person filed under two identities). 0 = off; range [0, 1).
config.interclass_filtering_threshold = 0.0
# AdaFace margin m (its paper: 0.4): the target logit is s * (cos(theta + g_angle) - g_add) with g_angle = -m
# * q and g_add = m + m * q for a quality q in [-1, 1] from the norm; >= 0.
config.adaface_m = 0.4
# AdaFace h (its paper: 0.333): q = clip(h * (norm - running mean) / running std, -1, 1); >= 0.
config.adaface_h = 0.333
# AdaFace t_alpha (its paper: 0.01): weight of each global batch in the running mean and std of the embedding
# norms; in (0, 1].
config.adaface_t_alpha = 0.01

# ---------------------------------------------------------------- Partial FC
# Fraction of class centres sampled per step (all positives + random negatives); range (0, 1]. 1 = full
# softmax.
config.sample_rate = 1.0
# Centres per class (sub-center ArcFace, ECCV 2020): a class's cosine is that of its closest centre, so noisy
# images of a class gather at a secondary centre instead of pulling the main one; 1 = one centre; >= 1.
config.sub_centers = 1
# What a step updates when sample_rate < 1: "sampled" (the Partial FC paper: only the sampled class centres
# and their optimizer state) | "all" (arcface_torch: every centre every step; momentum and weight decay also
# move unsampled ones; to reproduce its published numbers exactly). The same at sample_rate = 1.
config.head_update = "sampled"
# Run the fused margin-softmax's collective-free parts (cosines -> logits -> each row's max and exponentials;
# the local part of the backward) through torch.compile: fused loops with fewer passes over the (B, C)
# cosines, C++ on the CPU and Triton on CUDA from the same source; the same results up to rounding, after a
# first slow step. Meant for GPUs: on CPUs inductor's loops measured slower than eager (bench/README.md).
config.compile_head = False

# ---------------------------------------------------------------- precision
# Mixed precision with float16 autocast and dynamic loss scaling (one skip-or-step decision for backbone and
# head on every rank; the scale backs off on a skip and doubles after 100 good steps). Not together with bf16.
config.fp16 = False
# Mixed precision with bfloat16 autocast (no loss scaling needed). Not together with fp16.
config.bf16 = False
# Let fp32 matrix products and convolutions use TF32 tensor cores on CUDA (faster, ~1e-3 relative rounding, as
# most trainers do); False = full fp32. Ignored on the CPU.
config.tf32 = True
# cuDNN times its convolution algorithms on the first batches and keeps the fastest for each shape (the input
# size is fixed: 112x112), as arcface_torch sets it; False = cuDNN's heuristics. Ignored on the CPU.
config.cudnn_benchmark = True

# ---------------------------------------------------------------- optimisation
# Images per rank per forward pass (micro-batch); >= 1. Global batch = batch_size * world_size.
config.batch_size = 128
# Optimizer for backbone and head: "sgd" | "adamw". arcface_torch's AdamW recipes use lr 0.001, wd 0.1.
config.optimizer = "sgd"
# Peak learning rate (reached at the end of warm-up, then polynomial decay to 0 with power lr_power); > 0.
config.lr = 0.1
# Power of the decay after warm-up: lr * (1 - progress) ** lr_power. 1 = linear, as arcface_torch's current
# trainer; 2 = its older PolyScheduler and this trainer before the key existed (checkpoints written then
# resume with lr_power = 2); finite and > 0.
config.lr_power = 1.0
# SGD momentum, or AdamW beta1; range [0, 1).
config.momentum = 0.9
# Weight decay (L2 for SGD, decoupled for AdamW); >= 0.
config.weight_decay = 0.0005
# Micro-batches accumulated per optimizer step; >= 1. The LR schedule counts optimizer steps.
config.gradient_acc = 1
# Clip the backbone's gradient norm to this value (arcface_torch clips at 5); 0 = no clipping; >= 0.
config.clip_grad_norm = 5.0
# Stop the job after this many optimizer steps in a row skipped for a non-finite loss or gradient; >= 1.
config.max_nonfinite_steps = 10
# An image that cannot be read or decoded stops the run with one line naming it (False), or is left out of its
# batch and listed in the log (True).
config.skip_bad_images = False

# ---------------------------------------------------------------- fine-tuning (docs/finetuning.md)
# The backbone's learning rate as a multiple of the head's (the schedule's lr): a backbone that starts from
# init_backbone moves less than the fresh head; finite and > 0 (1 = both at lr).
config.backbone_lr_scale = 1.0
# Keep every batch-norm layer of the backbone in eval mode while training: it normalises with its running
# statistics and never updates them (small or one-sided data estimates them worse than the pre-training did);
# its affine weights still train unless their stage is frozen.
config.freeze_bn = False
# Freeze the stem and the first N stages of the backbone (no gradient, no update, batch-norm statistics kept):
# IResNet stem = conv1/bn1/prelu, stages layer1..layer4; MobileFaceNet stem = its first two units, stages =
# each stride-2 bottleneck with its residual blocks (3); ViT stem = patch_embed and pos_embed, stages = its
# blocks (depth). 0 = nothing frozen; >= 0 and at most the network's stage count.
config.freeze_stages = 0
# Train the head alone for this many optimizer steps: the backbone runs as at inference (eval mode, no
# gradient) and stays bit for bit as it is, so the fresh class centres settle before their gradients reach the
# backbone; then the whole network trains. Counted in optimizer steps from step 0 (a resumed run inside it
# continues it); >= 0 (0 = none).
config.head_warmup_steps = 0

# ---------------------------------------------------------------- data
# Training data: a folder holding train.rec/train.idx (insightface RecordIO), a folder of identity folders, or
# "synthetic" (random images, for speed tests and CI).
config.rec = "synthetic"
# Number of identities (classes) in the training set; >= 1 and >= world size. None = what the dataset says
# (its property file or header record, the identity folders), filled in and logged by the trainer; synthetic
# data and the DALI loader need it set.
config.num_classes = None
# Number of training images; it sets the steps per epoch (num_image // (batch_size * world * gradient_acc)).
# None = what the dataset holds (its index, the image files; synthetic data: 10 per class), filled in and
# logged by the trainer.
config.num_image = None
# Epochs to train; >= 1 unless max_steps > 0.
config.num_epoch = 20
# Epochs of linear learning-rate warm-up from 0 (0 = none); >= 0.
config.warmup_epoch = 0
# Train for this many optimizer steps instead of num_epoch epochs; 0 = derive from num_epoch; >= 0.
config.max_steps = 0
# NVIDIA DALI loader (GPU JPEG decoding; needs the optional nvidia-dali package, e.g. nvidia-dali-cuda120, a
# CUDA device and num_classes set). Fed by index: the PyTorch loader's batches and flips, and a resumed run
# starts at its step without decoding the batches before it.
config.dali = False
# arcface_torch's extra DALI augmentation (random down-and-up resize, blur, hue/saturation shift, grayscale).
# Refused: only False is accepted. Our loaders make every image a function of (seed, epoch, sample) so that a
# resumed or resized run sees the same batches, and DALI's GPU operators have no exact CPU counterpart, so the
# two loaders would train on different images. Recipes that set it train without it (their docstring says so).
config.dali_aug = False
# Data-loading worker processes per rank; >= 0 (0 = load in the training process).
config.num_workers = 2
# Seed for weights, Partial FC sampling, shuffling and flips; >= 0.
config.seed = 2048

# ---------------------------------------------------------------- evaluation and logging
# Verification sets evaluated during training, looked up as <rec>/<name>.bin (missing files are skipped).
config.val_targets = ["lfw", "cfp_fp", "agedb_30"]
# Evaluate on val_targets every this many optimizer steps; >= 1.
config.verbose = 2000
# Log loss, throughput and learning rate every this many optimizer steps; >= 1.
config.frequent = 10
# Weights & Biases (arcface_torch's keys): rank 0 also logs to a wandb run, in <output>/wandb. Needs the
# optional wandb package (pip install wandb); WANDB_MODE=offline logs without a network (wandb sync uploads
# later). A run that cannot start is one warning and training goes on.
config.using_wandb = False
# wandb API key; None = the login wandb already has (wandb login, WANDB_API_KEY); arcface_torch's placeholder
# of X's counts as None. Never logged, saved in checkpoints or written to ~/.netrc.
config.wandb_key = None
# Team or user the run belongs to; None = wandb's default entity.
config.wandb_entity = None
# wandb project; None = wandb's default.
config.wandb_project = None
# The run's name is its start time (yymmdd_HHMM), then "_" and this suffix when set.
config.suffix_run_name = None
# Notes shown with the wandb run; None = none.
config.notes = None
# True: the run receives everything TensorBoard does (train/ at every progress line, val/); False: val/ only.
config.wandb_log_all = True
# True: every model.pt written at an epoch end or the last step becomes a new version of the run's model
# artifact.
config.save_artifacts = False
# True: a run in an output folder that already logged to wandb continues that wandb run (its id is kept in
# <output>/wandb_run.json); False: a new wandb run each time train.py starts.
config.wandb_resume = False

# ---------------------------------------------------------------- output and checkpoints
# Output folder (logs, model.pt, checkpoints/); None = work_dirs/<config file name without .py>.
config.output = None
# Resume: False = start fresh (or auto_resume); True = continue from the newest complete checkpoint under
# `output` (error if none); a path = continue from that checkpoint directory.
config.resume = False
# True: when `output` holds a complete checkpoint whose config fingerprint matches, continue from it.
config.auto_resume = True
# Write resumable checkpoints (backbone, optimizers, scaler, RNG, head shards) at every epoch end and every
# save_every_steps. On by default so that a crashed job loses at most an epoch, or save_every_steps steps when
# that is set; False = write only the backbone weights (output/model.pt, with its model.json), as
# arcface_torch does by default.
config.save_all_states = True
# Also checkpoint every this many optimizer steps; 0 = only at epoch end; >= 0. Epochs shorter than this write
# no checkpoint at their end (a small dataset's epochs of a few steps would write one each).
config.save_every_steps = 0
# A folder belongs to one run. True: a run that will not continue the checkpoints already in `output` (another
# config's, auto_resume = False, or ones newer than resume = PATH) moves them, with model.pt and model.json,
# to output/archive_<time>/ and starts; False: such a run refuses to start (it would delete or shadow them).
config.archive_checkpoints = False
# Complete checkpoints kept under output/checkpoints (older ones are deleted); >= 1.
config.keep_checkpoints = 2

# ---------------------------------------------------------------- runtime
# Where to train: "auto" (CUDA when available, else CPU) | "cpu" | "cuda".
config.device = "auto"
# Timeout of collective operations in the process group, in minutes; >= 1.
config.dist_timeout_minutes = 30
