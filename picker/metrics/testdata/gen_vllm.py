# Generates a vLLM-0.11-shaped /metrics page fixture for switchyard tests.
import random
random.seed(7)
out = []
def fam(name, typ, help_):
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {typ}")
for g in ["0", "1", "2"]:
    pass
fam("python_gc_objects_collected_total", "counter", "Objects collected during gc")
for g in ["0","1","2"]:
    out.append(f'python_gc_objects_collected_total{{generation="{g}"}} {random.randint(100,90000)}.0')
fam("python_gc_collections_total", "counter", "Number of times this generation was collected")
for g in ["0","1","2"]:
    out.append(f'python_gc_collections_total{{generation="{g}"}} {random.randint(10,2000)}.0')
fam("python_info", "gauge", "Python platform information")
out.append('python_info{implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"} 1.0')
for n,t,v in [("process_virtual_memory_bytes","gauge","5.3e+10"),("process_resident_memory_bytes","gauge","4.1e+09"),("process_start_time_seconds","gauge","1.76381e+09"),("process_cpu_seconds_total","counter","1834.2"),("process_open_fds","gauge","112.0"),("process_max_fds","gauge","1.048576e+06")]:
    fam(n,t,n.replace("_"," "))
    out.append(f"{n} {v}")
M = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
fam("vllm:num_requests_running","gauge","Number of requests in model execution batches.")
out.append(f"vllm:num_requests_running{{{M}}} 7.0")
fam("vllm:num_requests_waiting","gauge","Number of requests waiting to be processed.")
out.append(f"vllm:num_requests_waiting{{{M}}} 3.0")
fam("vllm:kv_cache_usage_perc","gauge","KV-cache usage. 1 means 100 percent usage.")
out.append(f"vllm:kv_cache_usage_perc{{{M}}} 0.4213")
for n,h,v in [("vllm:prefix_cache_queries_total","Prefix cache queries, in terms of number of queried tokens.",918272),("vllm:prefix_cache_hits_total","Prefix cache hits, in terms of number of cached tokens.",601232),("vllm:num_preemptions_total","Cumulative number of preemption from the engine.",4),("vllm:prompt_tokens_total","Number of prefill tokens processed.",1203912),("vllm:generation_tokens_total","Number of generation tokens processed.",402112)]:
    fam(n,"counter",h)
    out.append(f"{n}{{{M}}} {v}.0")
fam("vllm:request_success_total","counter","Count of successfully processed requests.")
for r in ["stop","length","abort"]:
    out.append(f'vllm:request_success_total{{{M},finished_reason="{r}"}} {random.randint(0,5000)}.0')
def hist(name, help_, buckets, scale):
    fam(name,"histogram",help_)
    c = 0
    total = 0.0
    for b in buckets:
        c += random.randint(0, 300)
        total += c * b * scale
        out.append(f'{name}_bucket{{{M},le="{b}"}} {c}.0')
    out.append(f'{name}_bucket{{{M},le="+Inf"}} {c}.0')
    out.append(f"{name}_count{{{M}}} {c}.0")
    out.append(f"{name}_sum{{{M}}} {total:.6f}")
lat = [0.001,0.005,0.01,0.02,0.04,0.06,0.08,0.1,0.25,0.5,0.75,1.0,2.5,5.0,7.5,10.0]
hist("vllm:time_to_first_token_seconds","Histogram of time to first token in seconds.",lat,0.1)
hist("vllm:inter_token_latency_seconds","Histogram of inter-token latency in seconds.",[0.01,0.025,0.05,0.075,0.1,0.15,0.2,0.3,0.4,0.5,0.75,1.0],0.1)
hist("vllm:e2e_request_latency_seconds","Histogram of e2e request latency in seconds.",[0.3,0.5,0.8,1.0,1.5,2.0,2.5,5.0,10.0,15.0,20.0,30.0],0.1)
hist("vllm:request_queue_time_seconds","Histogram of time spent in WAITING phase for request.",[0.3,0.5,0.8,1.0,1.5,2.0,2.5,5.0,10.0],0.1)
hist("vllm:request_prefill_time_seconds","Histogram of time spent in PREFILL phase for request.",[0.3,0.5,0.8,1.0,1.5,2.0,2.5,5.0,10.0],0.1)
hist("vllm:request_decode_time_seconds","Histogram of time spent in DECODE phase for request.",[0.3,0.5,0.8,1.0,1.5,2.0,2.5,5.0,10.0],0.1)
hist("vllm:request_prompt_tokens","Number of prefill tokens processed.",[1,2,5,10,20,50,100,200,500,1000,2000,5000,10000],1)
hist("vllm:request_generation_tokens","Number of generation tokens processed.",[1,2,5,10,20,50,100,200,500,1000],1)
hist("vllm:iteration_tokens_total","Histogram of number of tokens per engine_step.",[1,8,16,32,64,128,256,512,1024,2048,4096,8192],1)
fam("vllm:cache_config_info","gauge","Information of the LLMEngine CacheConfig")
out.append('vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27904",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0')
fam("vllm:lora_requests_info","gauge","Running stats on lora requests.")
out.append('vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7638101e+09')
out.append('vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="tone-lora"} 1.7638104e+09')
out.append('vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7638092e+09')
print("\n".join(out))
