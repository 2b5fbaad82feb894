-- kvfleet.io/TenantQuota: the routers write its Ready condition. Enforced is Healthy; a quota
-- superseded by another for the same tenant is Degraded. A quota no router has reported on yet
-- is Healthy (it was admitted by the webhook and is enforced as soon as a router watches its
-- namespace): a namespace without routers must not leave the Application Progressing for ever.
-- Argo CD runs this in gopher-lua with only the base, table and os libraries.
local hs = {}
local ready = nil
if obj.status ~= nil and obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    if condition.type == "Ready" then
      ready = condition
    end
  end
end
if ready == nil then
  hs.status = "Healthy"
  hs.message = "Admitted; no router has reported on it yet"
  return hs
end
if obj.metadata.generation ~= nil and ready.observedGeneration ~= nil
    and ready.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the routers to enforce generation " ..
    tostring(obj.metadata.generation)
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
else
  hs.status = "Degraded"
end
hs.message = tostring(ready.reason) .. ": " .. tostring(ready.message)
return hs
