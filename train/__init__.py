"""Training a DFlash drafter for a target: the prompt set, response generation, training, export."""
