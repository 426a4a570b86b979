"""The EAGLE-3 draft itself: vocabulary and model."""
