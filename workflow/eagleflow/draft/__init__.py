"""The EAGLE-3 draft: vocabulary, model, data, training, export, acceptance."""
