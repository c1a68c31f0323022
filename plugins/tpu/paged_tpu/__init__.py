"""paged-tpu: the TPU platform plugin for paged (torch_xla on PJRT).

Importing this package never imports torch_xla: that happens when the platform is used.
"""
