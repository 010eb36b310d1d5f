"""Per-image transforms: the recipe every loader applies, and its pieces for Pillow, torch and DALI.

- the recipe: ``recipe`` (`Recipe`, `Progressive`), ``draws`` (per-sample random draws), ``resize`` (crop
  boxes and the resize), ``batch`` (batch operations on the device), ``mix`` (mixup and cutmix);
- decoding: ``decode`` (the one decoding rule), ``decode_choice`` and ``decode_probe`` (how DALI decodes on
  this machine, and the child that probes it), ``mixed_decoder`` (how a pipeline's GPU decoder is set
  up: paddings, hints, load, affinity), ``opencv`` (OpenCV's kernels where they are faster);
- each backend's side: ``pillow`` (the plain DataLoader's), ``autoaugment`` (the augmentation suites on
  Pillow images), ``dali`` (the DALI operators).
"""
