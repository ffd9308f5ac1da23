"""Code shared by train_bert_cls.py and train_resnet.py, one module per concern; text_* serve the BERT script,
image_* the ResNet script, the rest both. What a user changes to adapt a script (the model, the loss, the transforms or
tokenising, the evaluation's numbers) is in the script's adaptation section: these modules take it as arguments and
never name a model class or a list of allowed transforms; the metrics they compute (text_metrics.py, image_data.py's
top-k) are computed where the script's evaluate calls them. The module map:

both scripts
  runtime.py     the Accelerator and the launches refused because they would go wrong silently (a second run on
                 an output directory: its lock), how kernels are chosen (cuDNN's autotuner, or deterministic
                 kernels with --use_deterministic_algorithms), DataLoader settings, the --help look and the
                 parser's number checks, UserError and run_cli (one-line errors, exit status 2; Ctrl-C), a problem on
                 one rank stopping all of them (a failure to write: a full disk), stops that reach every process
                 (loader workers leave them to their parent, ranks stop with their launcher, a rank that stopped
                 answering is named: RollCall)
  flags.py       the command line: the parser (a refused flag or value costs one line, with what replaces it or
                 the closest flag), the peers' spellings (Trainer, run_classification, accelerate's examples, the
                 Chinese BERT tutorial, main.py, torchvision, timm) read with their meaning and said once
  loop.py        the training loop's bookkeeping, one optimizer step walked through in its header: Cadence,
                 LossScale, ClassWeights (--class_weights), LossMeter, HealthCheck, Throughput, PreemptionGuard,
                 epoch_batches; Selection (the best model's metric and early stopping); micro-batches and the retry
                 after an out-of-memory error (--auto_find_batch_size: Attempt, OutOfMemoryRetry)
  checkpoint.py  resumable checkpoints: Checkpoints (save, restore, rotate, latest; modules such as the EMA as
                 safetensors), agreeing on the one to resume from and checking its files, what a resume must match
                 (the training data's fingerprint too) and may change: each flag's role (Role, FlagRoles,
                 roles_beside; the scripts' FLAG_ROLES), which --help shows
  export.py      weights in and out: exports under the model's own names, BestWeights, reading an export back
                 on every rank, PyTorch files read without running code and checked whole, the settings an export
                 carries
  outputs.py     what a run writes about itself: RunLog (metrics.jsonl, results files, run_config.json, trackers
                 and their one run across restarts,
                 secrets such as --token masked), each step's samples per process (--log_sample_indices: SampleLog,
                 read_sample_indices), the model card, console lines, progress bar, training curves, the output
                 directory's policy
  demo_data.py   built-in data for `make demo`, the tests and the benchmarks
  onnx_export.py --export_onnx: the selected model as ONNX (dynamic batch and sequence axes), optional int8, checked
                 by onnxruntime in a second process against PyTorch (agreement, accuracy, CPU latency)
train_bert_cls.py
  text_data.py   text files (cnews .txt/.tsv, CSV, JSON) and `datasets` datasets (--dataset_name), labels, the
                 --max_*_samples cuts, tokenising (long texts: --truncation, --doc_stride windows), padding,
                 length-grouped sampling
  text_cache.py  the tokenised data cache: the files read and tokenised once, by one process (one per node on
                 node-local disks), into memory-mapped Arrow files every rank and later start reads; its key
  text_model.py  where the model's files come from (--config_name, --tokenizer_name, hub options), loading the
                 classifier from any checkpoint layout, tokenizer and task checks, best.pt, gradient checkpointing,
                 AdamW groups
  text_metrics.py loss, metrics and predictions, single-label, multi-label and regression; the selection metric;
                 confusion matrix; --metric modules
train_resnet.py
  image_data.py  ImageFolder decoding to RGB with unreadable files marked, --dummy data, image counts, top-k; the
                 images --predict labels and predictions.jsonl's rows
  image_augment.py the augmentation flags and image sizes (the presets themselves are the script's), repeated
                 augmentation, MixUp/CutMix
  image_optim.py torchvision's optimizer, weight-decay groups and schedule; the model EMA
  image_model.py the image model: torchvision or timm, starting weights (torchvision's, timm's hub cache, local
                 files) with a new head for the data's classes, drop path, gradient checkpointing
  image_references.py main.py's, torchvision's and timm's refused flags, the batch-size rule, .pth checkpoint files
  image_device_decode.py --decode_on_device: JPEGs decoded on the training device, the script's transform
                 pipeline replayed there (what cannot be replayed refused at start-up)

Dependencies point one way: text_* and image_* use the shared modules, never each other; among those, runtime.py is used by
all, and outputs.py and loop.py use checkpoint.py.
"""
