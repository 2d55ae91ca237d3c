"""The demo's three LoRA adapters for SmolLM2-135M-Instruct, trained with peft on CPU from data this
package generates: ``french`` answers in French, ``pirate`` talks like a pirate, ``sql`` ends every
answer with a SQL query.

Outside the ``loramesh`` SDK package on purpose: training needs torch, transformers and peft, which
the SDK does not. ``python -m demo_adapters --preview`` trains them (or finds them cached) and
shows their answers next to the base model's.
"""
