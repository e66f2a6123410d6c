"""From a folder of raw photos to a training set: the library of ``scripts/prepare_faces.py``.

- ``photos.listing``: the photos (the identity-folder rule of ``dataset.identity_folders``, or a list file),
  their order, and landmarks a user gives;
- ``photos.policy``: which detected faces a photo keeps, and why (``decide``), apart from the detections;
- ``photos.pipeline``: decode, detect (``alignment``), decide and align each photo, chunk by chunk;
- ``photos.work``: the resumable work folder the chunks are saved in;
- ``photos.holdout``: the held-out identities and their verification pairs;
- ``photos.report``: ``report.csv`` and ``preview.png``;
- ``photos.pack``: the output folder, written through ``utils.files.staged`` (``dataset`` writes the rec and
  the ``.bin``);
- ``photos.prepare``: all of it, from the input to the output (``prepare``).

This package imports ``alignment``, ``dataset`` and ``utils``; what it leaves out it logs (the ``photos``
logger, which the tool prints as its lines). The user's manual is docs/data.md ("From your own photos").
"""
