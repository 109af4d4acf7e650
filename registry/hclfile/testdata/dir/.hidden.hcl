this is = not { valid hcl
