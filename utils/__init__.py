"""Code shared by train_bert_cls.py and train_resnet.py, one module per concern: text_* serve the BERT script, image_*
the ResNet script, the rest both. They take what a user adapts (model, loss, transforms, metrics) as arguments. The map
of what each module owns and which modules use which: docs/code.md#the-modules.
"""
