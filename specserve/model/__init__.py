"""The model path: layers, the parameterised decoder, weight loading and the runner."""
