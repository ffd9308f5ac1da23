"""Pieces shared by train_bert_cls.py and train_resnet.py, one job per module."""
