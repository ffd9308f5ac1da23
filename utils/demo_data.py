"""Built-in data for `make demo`, the tests and the benchmarks, written in the real on-disk formats:
- text: cnews-style `label<TAB>text` files of Chinese "headlines" from per-class vocabulary, with cross-class noise
  (learnable, not trivial), and a model directory (config.json, vocab.txt) for `--from_scratch`: no hub, no weights;
- images: scikit-learn's 1,797 real 8x8 handwritten digits, upscaled, as ImageFolder PNGs (train/ and val/<class>/);
- photos: ImageNet-sized JPEGs cut from scikit-learn's two bundled photos, for the decoding benchmarks and tests.
"""
import json
import random
from pathlib import Path

import numpy as np

TOPICS = {  # the 10 cnews classes, each with words typical of its headlines
    "体育": "比赛 球队 冠军 进球 联赛 教练 球员 决赛 奥运 金牌 赛季 主场",
    "财经": "股市 银行 利率 投资 基金 上涨 经济 货币 融资 市场 指数 财报",
    "房产": "楼盘 房价 开发商 地产 住宅 成交 购房 户型 物业 土地 限购 租金",
    "家居": "家具 装修 客厅 卧室 设计 沙发 厨房 风格 灯具 地板 收纳 软装",
    "教育": "学生 高考 学校 老师 考试 招生 课程 大学 留学 培训 录取 毕业",
    "科技": "手机 芯片 互联网 软件 智能 电脑 发布 网络 数据 系统 屏幕 处理器",
    "时尚": "时装 模特 品牌 搭配 潮流 美容 服饰 香水 设计师 街拍 秀场 妆容",
    "时政": "会议 政府 部门 改革 政策 代表 官员 外交 总理 发展 建设 法律",
    "游戏": "玩家 网游 副本 角色 版本 公测 任务 装备 关卡 战斗 服务器 职业",
    "娱乐": "电影 明星 导演 演员 票房 歌手 综艺 专辑 演唱会 首映 剧组 粉丝",
}
FILLER = "今天 记者 报道 表示 近日 消息 情况 相关 目前 已经 方面 我们 新的 一个 中国 北京 上海 国内".split()
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_headline(rng, label, noise):
    words = rng.sample(TOPICS[label].split(), rng.randint(2, 4)) + rng.sample(FILLER, rng.randint(2, 5))
    if rng.random() < noise:  # a word of another class, as in real headlines that mention two topics
        words.append(rng.choice(TOPICS[rng.choice([t for t in TOPICS if t != label])].split()))
    rng.shuffle(words)
    return "".join(words)


def write_text_classification_data(out_dir, n_train=2000, n_val=300, n_test=300, seed=0, noise=0.3,
                                   labels=None):
    """train.txt / val.txt / test.txt (cnews format) and model/ (config.json + vocab.txt of a small BERT)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    labels = labels or list(TOPICS)
    for name, n in (("train.txt", n_train), ("val.txt", n_val), ("test.txt", n_test)):
        lines = [f"{labels[i % len(labels)]}\t{make_headline(rng, labels[i % len(labels)], noise)}\n"
                 for i in range(n)]
        rng.shuffle(lines)
        (out_dir / name).write_text("".join(lines), encoding="utf-8")
    write_small_bert(out_dir / "model")
    return out_dir


def write_small_bert(model_dir, hidden_size=64, layers=2, heads=2):
    """config.json + vocab.txt (one token per character of the demo vocabulary) for --from_scratch."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    chars = sorted({c for words in TOPICS.values() for c in words.replace(" ", "")} | {c for w in FILLER for c in w})
    vocab = SPECIAL_TOKENS + chars
    (model_dir / "vocab.txt").write_text("".join(f"{token}\n" for token in vocab), encoding="utf-8")
    config = {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": len(vocab),
        "hidden_size": hidden_size, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": 4 * hidden_size, "max_position_embeddings": 512, "type_vocab_size": 2,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0,
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}), encoding="utf-8")
    return model_dir


def write_digits_imagefolder(out_dir, size=32, val_fraction=0.25, seed=0, limit=None):
    """scikit-learn's real 8x8 digits as RGB PNGs (size x size) in train/<digit>/ and val/<digit>/."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, targets = digits.images, digits.target  # (N, 8, 8) in 0..16, (N,)
    order = np.random.default_rng(seed).permutation(len(images))[:limit]
    n_val = int(len(order) * val_fraction)
    out_dir = Path(out_dir)
    for position, index in enumerate(order):
        split = "val" if position < n_val else "train"
        folder = out_dir / split / str(targets[index])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (images[index] * (255.0 / 16.0)).astype(np.uint8)
        image = Image.fromarray(pixels, mode="L").resize((size, size), Image.BILINEAR).convert("RGB")
        image.save(folder / f"{index:04d}.png")
    return out_dir


def write_photo_imagefolder(out_dir, n_train, n_val=0, longer_side=500, seed=0, quality=90):
    """ImageNet-sized JPEGs (longer side 500 px by default) made from scikit-learn's two bundled photos (china.jpg,
    flower.jpg, 427 x 640): each a random crop of 50-100% of either side, resized, randomly flipped, in
    train/<photo>/ and val/<photo>/. A fixture for decoding speed and exactness, not for learning."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    bundled = load_sample_images()
    photos = {Path(name).stem: Image.fromarray(pixels) for name, pixels in zip(bundled.filenames, bundled.images)}
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    for i in range(n_train + n_val):
        name = sorted(photos)[i % len(photos)]
        photo = photos[name]
        w, h = (int(side * rng.uniform(0.5, 1.0)) for side in photo.size)
        left, top = int(rng.integers(0, photo.width - w + 1)), int(rng.integers(0, photo.height - h + 1))
        scale = longer_side / max(w, h)
        image = photo.crop((left, top, left + w, top + h)).resize((round(w * scale), round(h * scale)),
                                                                  Image.BILINEAR)
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        folder = out_dir / ("train" if i < n_train else "val") / name
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i:05d}.jpg", quality=quality)
    return out_dir
