"""The reward for antonyms.jsonl, written as for TRL's GRPOTrainer: keywords prompts, completions and the dataset's
other columns (here answer and pos), one float per completion."""


def first_word(prompts, completions, answer, pos, **kwargs):
    """1.0 when the completion's first word is the expected opposite (case and punctuation ignored), else 0.0."""
    words = [(c.split() or [""])[0].strip(".,!'\"").lower() for c in completions]
    return [float(w == a) for w, a in zip(words, answer)]
