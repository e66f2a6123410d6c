"""The trainer's glue beside ``train.py``: what turns a config into a run and a run into checkpoints.

- ``trainer.preflight``: the ranks agree on the config's paths before anything is built (``check_on_every_rank``);
- ``trainer.build``: the run's parts from the config (``build`` → ``Job``; ``build_backbone``);
- ``trainer.finetune``: what fine-tuning freezes (stages, batch-norm statistics) and the head-only steps;
- ``trainer.parallelize``: the plain backbone wrapped for the step: DDP, its fp16 hook, ``torch.compile``;
- ``trainer.run_state``: where a run is and what it means (``TrainState``, the LR of a step, a resume's rules);
- ``trainer.checkpointing``: the one writer of the run checkpoint, and how a run starts from its folder;
- ``trainer.output_lock``: one run per output folder (``run.lock``);
- ``trainer.import_arcface``: an arcface_torch run's checkpoints converted into ours.

``train.py`` keeps the arguments, the one optimizer step, the loop and the entry point.
"""
