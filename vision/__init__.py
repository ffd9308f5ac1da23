"""The image classifier's shared code (train_resnet.py): data.py, augment.py, optim.py, references.py, device_decode.py.
Module map: common/__init__.py."""
