"""Models out of (and into) the toolkit: safetensors, ONNX, Hugging Face transformers.

``toolkit-export --path CKPT --format safetensors|onnx|hf --out DIR`` (see ``toolkit.export.api``);
one module per format. Checkpoints are read through ``toolkit.inference.load_model``
(``weights_only``). onnx/onnxruntime/onnxscript and transformers are optional
(``pip install toolkit[export]``).
"""
