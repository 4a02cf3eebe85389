"""Integrations: memfit on Hugging Face models (``hf``: enable, disable, ``MemfitCallback``
for ``transformers.Trainer``), in Lightning (``lightning.MemfitCallback``) and under
DeepSpeed's engine (``deepspeed.initialize``).

Imported lazily, never at ``import memfit``; ``memfit.fit`` looks up ``hf_state``'s hooks
only for a model that looks like a Hugging Face one (NOTE [Hugging Face models in fit] in
``memfit.api``).
"""
