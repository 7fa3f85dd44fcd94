"""What a step needs from the frameworks, beside the memory readers of :mod:`memguard.backends`:
training state copied for ``restore=`` (torch and Keras), gradients set aside and merged,
FSDP2's collectives held, activations recomputed or offloaded to pinned host memory, a
Dataset's samples collated.

Like every backend, each module here imports torch only inside its functions.
"""
