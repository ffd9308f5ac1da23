"""Training curves as a PNG, drawn from the events in metrics.jsonl (files only: matplotlib's Agg backend)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_training_curves(train_events, eval_events, png_path, steps_per_epoch, title="training curves"):
    """Loss and top-1 accuracy (%) against epochs: training at each log line, validation after each epoch.

    train_events: dicts with step, loss and acc1; eval_events: dicts with epoch, loss and acc1.
    """
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    train_x = [e["step"] / steps_per_epoch for e in train_events]
    eval_x = [e["epoch"] for e in eval_events]
    for ax, key, label in ((loss_ax, "loss", "loss"), (acc_ax, "acc1", "top-1 accuracy (%)")):
        ax.plot(train_x, [e[key] for e in train_events], label="train", alpha=0.7)
        ax.plot(eval_x, [e[key] for e in eval_events], "o-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
