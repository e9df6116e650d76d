"""How the models' forwards run on the device: the attention path and its choice (``attention``, its
names in ``names``), variable-length attention for packed rows (``varlen``), CUDA graph capture
(``graphs``) and a CUDA stream per role (``streams``), each with its CPU stand-in
(``docs/gpu-shapes.md``)."""
