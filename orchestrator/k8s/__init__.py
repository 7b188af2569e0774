"""The Kubernetes operator: the TfsnJob CRD, kopf handlers around the controller, the `.status` writer."""
