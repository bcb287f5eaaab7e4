// placeholder, replaced by the core layer
