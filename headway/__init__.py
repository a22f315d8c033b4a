"""headway: train Medusa / EAGLE draft heads on a frozen Hugging Face LM and decode faster, exactly."""

__version__ = "0.1.0"
