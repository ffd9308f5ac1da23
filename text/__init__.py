"""The text classifier's shared code (train_bert_cls.py): data.py, model.py, metrics.py.
Module map: common/__init__.py."""
