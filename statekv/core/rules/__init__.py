"""The carry rules: which tokens a layer carries into the next step."""
